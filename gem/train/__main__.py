"""`python -m gem.train [overrides...]`: the Hydra entry point (single process or under torchrun).

Before Hydra runs the job: the config is composed and checked once (a bad value prints one line naming the key
and exits 2), the process group is created (once, outside the job), and rank 0 picks the run name that every
rank then shares (`GEM_RUN_ID`; Hydra's default `${now:...}` would differ per rank), the same for every attempt of
one torchrun job, so a restarted job resumes in its run dir (`train.resume=auto`). Only rank 0 writes Hydra's
files and logs. `--check` validates the config and exits (0 if it is good); `--help` explains (gem/train/help.py).

A problem the user can fix (gem._config.UserError: config, data, checkpoint) found on any rank is printed once as
`gem-train: error: ...` by the first rank to claim it in torchrun's store, with exit status 2; the other ranks
leave quietly, without the traces of their broken collectives. Any other exception keeps its trace.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from gem._config import UserError
from gem.train.help import default_config_dir

CONFIG_DIR = default_config_dir()
EXIT_CONFIG = 2  # a problem the user can fix: config, data, checkpoint


def _err(msg: str) -> None:
    print(f"gem-train: error: {msg}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    """A one-line message for a config exception, naming the key where the exception knows it."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, UserError):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, name = exc.missing_cfg_file.rsplit("/", 1)
        options = f" (options: {', '.join(exc.options)})" if exc.options else ""
        return f"{group}={name}: no such config{options}"
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        first = str(cause).splitlines()[0].strip()
        text = str(exc).splitlines()[0].strip()
        if "not in struct" in str(cause) or "Could not override" in text:
            return f"{cause.full_key}: unknown config key (append a new key with '+{cause.full_key}=...')"
        if "Missing mandatory value" in first:
            return f"{cause.full_key}: missing value (set {cause.full_key}=...)"
        return f"{cause.full_key}: {first}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _split_args(argv: list[str]) -> tuple[list[str], bool]:
    check = "--check" in argv
    return [a for a in argv if a != "--check"], check


def _overrides(argv: list[str]) -> list[str]:
    """The config overrides among the arguments (Hydra's own flags and their values left out; `--config-dir DIR`
    becomes the search-path entry Hydra gives it, so the pre-flight composition sees the user's configs too)."""
    out, skip = [], None
    for a in argv:
        if skip is not None:
            if skip in ("--config-dir", "-cd"):
                out.append(f"hydra.searchpath=[file://{os.path.abspath(a)}]")
            skip = None
            continue
        if a.startswith("-"):
            flag, eq, value = a.partition("=")
            if flag in ("--config-dir", "-cd") and eq:
                out.append(f"hydra.searchpath=[file://{os.path.abspath(value)}]")
            elif flag in ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                          "--experimental-rerun") and not eq:
                skip = flag
            continue
        out.append(a)
    return out


def preflight(overrides: list[str], world_size: int | None) -> str | None:
    """Compose the config and run every validator; returns None if good, else a one-line message."""
    return _checked(overrides, world_size)[0]


def _checked(overrides: list[str], world_size: int | None):
    """(None, the typed configs) when the composed config passes every validator, else (a one-line message,
    None)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_resolvers()
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR, job_name="gem_train"):
            cfg = compose(config_name="config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - any composition problem is a config error
        return _one_line(e), None
    finally:
        GlobalHydra.instance().clear()
    try:
        from gem.train.config import check_device
        from gem.train.trainer import build_configs

        cfgs = build_configs(cfg, world_size)
        check_device(cfgs)
        from gem.data.parquet import check_files

        check_files(cfgs.data)
    except Exception as e:  # noqa: BLE001 - config errors, omegaconf interpolation / missing-value errors
        return _one_line(e), None
    return None, cfgs


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("gem_run_id"):
        OmegaConf.register_new_resolver("gem_run_id", lambda: os.environ.get("GEM_RUN_ID", "local"), use_cache=True)


def _elastic_store():
    """A client of torchrun's own key-value store, which outlives the workers of one attempt; None when the workers
    are not given it (not under torchrun, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=600)
    )


def _agree_on_run_id(rank: int, world_size: int, store) -> None:
    """Every rank gets rank 0's GEM_RUN_ID: the environment's, else the one the first attempt of this torchrun job
    kept in torchrun's store (so a restarted job writes to the same run dir and resumes there), else a timestamp."""
    import torch.distributed as dist

    run_id = [os.environ.get("GEM_RUN_ID")]
    if rank == 0 and not run_id[0]:
        run_id[0] = time.strftime("%Y-%m-%d/%H-%M-%S")
        if store is not None:  # compare_set stores it if absent and returns the stored value
            run_id[0] = store.compare_set(f"gem/run_id/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", "", run_id[0])
            run_id[0] = run_id[0].decode() if isinstance(run_id[0], bytes) else run_id[0]
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            logging.getLogger("gem.train").warning(
                "restarted without torchrun's shared store: new run dir; pin hydra.run.dir to resume in the old one"
            )
    if world_size > 1:
        dist.broadcast_object_list(run_id, src=0)
    os.environ["GEM_RUN_ID"] = run_id[0]


def main(argv: list[str] | None = None, hooks: tuple = ()) -> int:
    """`hooks`: run after every training step with the Trainer (see gem.train.trainer.Trainer)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, check_only = _split_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "--help" in argv or "-h" in argv:
        if rank == 0:
            from gem.train.help import help_text

            sys.stdout.write(help_text(CONFIG_DIR))
        return 0
    if any(a in ("--hydra-help", "--info", "-i", "--cfg", "-c") for a in argv):
        return _run_hydra(argv, rank, None)

    problem, cfgs = _checked(_overrides(argv), world_size)
    if problem is not None:
        if rank == 0:
            _err(problem)
        return EXIT_CONFIG
    if check_only:
        if rank == 0:
            print("gem-train: config ok", flush=True)
        return 0

    from gem.parallel.dims import init_distributed

    store = _elastic_store()
    init_distributed(cfgs.parallel.timeout_s, store=store)  # once per process, outside Hydra's job
    _agree_on_run_id(rank, world_size, store)
    state: dict = {"store": store}
    code = _run_hydra(argv, rank, state, hooks)
    if code:
        return code
    if "error" in state:
        err, code = state["error"]
        if state.get("print", True):
            _err(err)
        if world_size > 1:  # first out, so torchrun names this rank as the root cause; no waiting on the group
            _quiet_exit(code)
        return code
    return 0


def _run_hydra(argv: list[str], rank: int, state: dict | None, hooks: tuple = ()) -> int:
    import hydra

    _register_resolvers()
    extra = []
    if rank != 0:
        # Ranks other than 0 write no .hydra/ files and no log file; their warnings still reach stderr.
        extra = ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra/hydra_logging=none"]

    def task(cfg) -> None:
        _job(cfg, rank, state if state is not None else {}, hooks)

    app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(task)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "gem-train"] + argv + extra
    try:
        app()
    except SystemExit as e:  # hydra exits 1 on errors it reports itself
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0


def _job(cfg, rank: int, state: dict, hooks: tuple = ()) -> None:
    from hydra.core.hydra_config import HydraConfig

    from gem.train.trainer import Trainer, summary_line

    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    run_dir = HydraConfig.get().runtime.output_dir
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir=run_dir, hooks=hooks)
        result = trainer.fit()
        if rank == 0:
            print(summary_line(result, trainer.tasks), flush=True)
    except (UserError, FloatingPointError) as e:  # the user can fix it: one line, from one rank
        state["error"] = (_one_line(e), EXIT_CONFIG)
        _claim_error(state)
    except (ValueError, TypeError) as e:
        if trainer is not None:
            _leave_if_a_peer_failed(state, e)
            raise
        state["error"] = (_one_line(e), EXIT_CONFIG)  # raised while building from the config (e.g. on this world)
        _claim_error(state)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        _leave_if_a_peer_failed(state, e)
        raise  # a real bug: its trace
    finally:
        if trainer is not None:
            trainer.close()


def _error_key() -> str:
    return f"gem/error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _claim_error(state: dict) -> None:
    """The first rank to report a user error prints it; the others (which found the same, or whose collectives
    broke because of it) stay quiet. Through torchrun's store, which outlives a dead rank's sockets."""
    store, rank = state.get("store"), os.environ.get("RANK", "0")
    owner = rank
    if store is not None:
        try:
            owner = store.compare_set(_error_key(), "", rank)
            owner = owner.decode() if isinstance(owner, bytes) else owner
        except Exception:  # noqa: BLE001 - the store is gone: print it ourselves
            owner = rank
    state["print"] = owner == rank
    if state["print"] and os.environ.get("GEM_ERROR_FILE"):  # scripts/train.sh turns it into exit status 2
        Path(os.environ["GEM_ERROR_FILE"]).write_text(state["error"][0] + "\n")


def _leave_if_a_peer_failed(state: dict, exc: BaseException) -> None:
    """Our collective broke because a peer stopped on a user error (it has printed it): leave quietly."""
    if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and _peer_failed(state):
        _quiet_exit(EXIT_CONFIG)


def _peer_failed(state: dict) -> bool:
    store = state.get("store")
    if store is None:
        return False
    try:
        return bool(store.check([_error_key()]))
    except Exception:  # noqa: BLE001
        return False


def _quiet_exit(code: int) -> None:
    """Leave without a trace and without waiting on the broken process group (destroying it could block)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.exit(code)

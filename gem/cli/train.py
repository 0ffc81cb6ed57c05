"""`gem-train` / `gem train` / `python -m gem.train [--check] [KEY=VALUE ...]`: train (one process or under torchrun).

One run, in order: the config is composed once (gem.config.compose) and checked, with the start-up checks of
`gem.train.preflight` (data files, run and checkpoint dirs, the checkpoint to resume); a problem prints one line
`gem-train: error: <key or path>: <what>` and exits 2. `--check` stops there (`gem-train: config ok`). Then the
process group is created, rank 0 picks the run id every rank shares (`GEM_RUN_ID`, the same for every attempt of
one torchrun job, so a restarted job resumes in its run dir), rank 0 locks the run dir (one job per run dir) and
writes Hydra's `.hydra/` files, and the Trainer runs.

SIGTERM, SIGINT and SIGUSR1 stop every rank at one step boundary with a checkpoint of that step
(gem.train.stop); the exit status says why: 0 done or stopped by SIGUSR1 (a wrapper requeues), 2 a problem the user
can fix, 130 / 143 stopped by SIGINT / SIGTERM. A user error found on any rank is printed once, by the first rank to
claim it in torchrun's store; the other ranks leave quietly, without the traces of their broken collectives. Any
other exception keeps its trace.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from gem.config import EXIT_USER, ConfigError, UserError, compose, default_config_dir, error_line, one_line, parse_args

TOOL = "gem-train"
# Hydra's informational flags: answered by Hydra's own app (nothing is trained).
_HYDRA_INFO = ("--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--package", "-p")


def _err(msg: str) -> None:
    print(error_line(TOOL, msg), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, hooks: tuple = ()) -> int:
    """Returns the exit status. `hooks`: run after every training step with the Trainer
    (gem.train.trainer.Trainer)."""
    from gem.cli.quiet import quiet_third_party

    quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "--help" in argv or "-h" in argv:
        if rank == 0:
            from gem.train.help import help_text

            sys.stdout.write(help_text(default_config_dir()))
        return 0
    if any(a.split("=", 1)[0] in _HYDRA_INFO for a in argv):
        return _hydra_info(argv)
    try:
        args = parse_args(argv)
        unknown = [f for f in args.flags if f != "--check"]
        if unknown:
            raise ConfigError(unknown[0], "unknown option (see --help)")
        extra = []
        if rank != 0:  # ranks other than 0 write no .hydra/ files and no log file; their warnings reach stderr
            extra = ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra/hydra_logging=none"]
        cfg = compose(args.overrides + extra, extra_dir=args.config_dir, config_name=args.config_name, hydra=True)
        job_cfg = _without_hydra(cfg)
        from gem.train.config import check_device
        from gem.train.trainer import build_configs

        cfgs = build_configs(job_cfg, world_size)
        check_device(cfgs)
        if "--check" in args.flags:
            from gem.train.preflight import preflight

            preflight(cfgs, os.path.abspath(str(cfg.hydra.run.dir)))  # a run-id dir: as a new one would be
            if rank == 0:
                print(f"{TOOL}: config ok", flush=True)
            return 0
    except Exception as e:  # noqa: BLE001 - config errors, omegaconf interpolation / missing-value errors
        if rank == 0:
            _err(one_line(e))
        return EXIT_USER
    return _run(cfg, cfgs, rank, world_size, hooks)


def _resume_hint(cfg) -> str:
    """How to continue a stopped run: the same command, pinned to this run dir where its name came from the
    launch."""
    from omegaconf import OmegaConf

    derived = "gem_run_id" in str(OmegaConf.to_container(cfg.hydra.run, resolve=False).get("dir"))
    if derived and not _pinned_run_id:
        return f"resume with the same command and hydra.run.dir={cfg.hydra.run.dir}"
    return "resume with the same command"


_pinned_run_id = bool(os.environ.get("GEM_RUN_ID"))


def _without_hydra(cfg):
    from omegaconf import OmegaConf, open_dict

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(out, True)
    with open_dict(out):
        del out["hydra"]
    return out


def _run(cfg, cfgs, rank: int, world_size: int, hooks: tuple) -> int:
    from gem.parallel.dims import init_distributed
    from gem.train.stop import StopSignals

    signals = StopSignals.install()  # before the first collective: a signal from here on stops cleanly
    store = _elastic_store()
    init_distributed(cfgs.comm.timeout_s, store=store)  # once per process
    state: dict = {"store": store}
    lock = None
    try:
        _agree_on_run_id(rank, world_size, store)
        run_dir, lock = _open_run_dir(cfg, cfgs, rank, world_size)
        _job(cfgs, run_dir, rank, state, hooks, signals, _resume_hint(cfg))
    except (UserError, FloatingPointError) as e:
        state["error"] = (one_line(e), EXIT_USER)
        _claim_error(state)
    finally:
        if lock is not None:
            lock.release()
        signals.uninstall()
    if "error" in state:
        err, code = state["error"]
        if state.get("print", True):
            _err(err)
        if world_size > 1:  # first out, so torchrun names this rank as the root cause; no waiting on the group
            _quiet_exit(code)
        return code
    return state.get("code", 0)


def _open_run_dir(cfg, cfgs, rank: int, world_size: int):
    """The run dir (resolved now that the run id is agreed), locked by rank 0, with Hydra's files and logging set up
    as Hydra's own app would; every rank learns whether rank 0 got the lock."""
    import torch.distributed as dist
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import _save_config, configure_log
    from omegaconf import open_dict, read_write

    from gem.train.preflight import preflight
    from gem.train.rundir import RunDirLock

    run_dir = os.path.abspath(str(cfg.hydra.run.dir))
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = run_dir
    HydraConfig.instance().set_config(cfg)
    lock, outcome, note = None, [None], None
    if rank == 0:
        try:
            preflight(cfgs, run_dir)
            lock = RunDirLock(run_dir, os.environ.get("GEM_RUN_ID", ""))
            stale = lock.acquire()
            if stale and stale.get("run_id") != lock.run_id:
                note = (f"run dir {run_dir}: took over the stale lock of {RunDirLock.describe(stale)} "
                        "(no longer running)")
        except UserError as e:
            outcome[0] = one_line(e)
    if world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise UserError(outcome[0])
    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)
    if note:
        logging.getLogger("gem.train").warning(note)
    if cfg.hydra.output_subdir is not None and rank == 0:
        out = Path(run_dir) / str(cfg.hydra.output_subdir)
        _save_config(_without_hydra(cfg), "config.yaml", out)
        _save_config(cfg.hydra, "hydra.yaml", out)
        _save_config(cfg.hydra.overrides.task, "overrides.yaml", out)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    return run_dir, lock


def _job(cfgs, run_dir: str, rank: int, state: dict, hooks: tuple, signals, resume_hint: str) -> None:
    from gem.train.stop import exit_status
    from gem.train.trainer import Trainer, summary_line

    trainer = None
    try:
        trainer = Trainer(cfgs, run_dir=run_dir, hooks=hooks, stop=signals)
        result = trainer.fit()
        if result.stopped_by is not None:
            state["code"] = exit_status(result.stopped_by)
            if rank == 0:
                where = f"checkpoint step_{result.steps} written" if result.last_checkpoint else "no checkpoint dir"
                print(f"{TOOL}: stopped by {result.stopped_by} at step {result.steps}; {where}; {resume_hint}",
                      file=sys.stderr, flush=True)
        elif rank == 0:
            print(summary_line(result, trainer.tasks), flush=True)
    except (UserError, FloatingPointError):
        raise
    except (ValueError, TypeError) as e:
        if trainer is not None:
            _leave_if_a_peer_failed(state, e)
            raise
        raise UserError(one_line(e)) from None  # raised while building from the config (e.g. on this world)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        _leave_if_a_peer_failed(state, e)
        raise  # a real bug: its trace
    finally:
        if trainer is not None:
            trainer.close()


def _hydra_info(argv: list[str]) -> int:
    """`--cfg job`, `--info`, `--hydra-help`: Hydra's own app answers (it composes for that answer only)."""
    import hydra

    from gem.config import register_resolvers

    register_resolvers()
    app = hydra.main(version_base="1.3", config_path=default_config_dir(), config_name="config")(lambda cfg: None)
    saved = sys.argv
    sys.argv = [saved[0] if saved else TOOL] + argv
    try:
        app()
    except SystemExit as e:  # hydra exits 1 on errors it reports itself
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0


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
    kept in torchrun's store (so a restarted job writes to the same run dir and resumes there), else a new one
    (gem.train.rundir.new_run_id: unique per launch)."""
    import torch.distributed as dist

    from gem.train.rundir import new_run_id

    run_id = [os.environ.get("GEM_RUN_ID")]
    if rank == 0 and not run_id[0]:
        run_id[0] = new_run_id()
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
        _quiet_exit(EXIT_USER)


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


def run(argv: list[str] | None = None) -> None:
    """The console script: main's status as the process's, after leaving the process group."""
    code = main(argv)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.exit(code)


if __name__ == "__main__":
    run()

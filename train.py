"""Train a GPT: ``python train.py [--config FILE] [key=value ...]``.

The same command runs under ``torchrun --nproc-per-node N train.py ...`` and under
``srun`` (see scripts/slurm/). With no arguments it trains the tiny default model
on the bundled sample corpus on whatever device is present. ``--help`` lists
every config key with its default and meaning.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from training.stop import StopFlag

    stop = StopFlag()  # before anything slow: a SIGTERM/SIGUSR1 during start-up must stop cleanly, not kill
    try:
        return _main(argv, stop)
    finally:
        stop.restore()


def _main(argv, stop) -> int:
    from config import ConfigError, describe, load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--config", help="YAML experiment config (values override the defaults)")
    parser.add_argument("-h", "--help", action="store_true", help="show the config keys and exit")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.max_steps=100")
    args = parser.parse_args(argv)
    if args.help:
        parser.print_help()
        print("\nconfig keys:\n" + "\n".join(describe()))
        return 0

    from parallel import restart

    try:
        if args.config:
            check_config_file(args.config)
        cfg = load_config(args.config, args.overrides)
        if restart.needs_supervisor(cfg.train.max_restarts):  # python train.py train.max_restarts=N: watch a child
            from config import validate_config

            validate_config(cfg)  # a bad setting is said once, here, not by each attempt
            return restart.supervise(sys.argv[1:] if argv is None else list(argv), cfg.train.max_restarts, stop,
                                     os.path.abspath(__file__))
    except ConfigError as e:
        return _error(e)

    from data.indexed import DataError
    from parallel import hang
    from parallel.comm import CommError
    from parallel.launch import LaunchError
    from training.checkpoint import CheckpointError
    from training.run_lock import RunLockError
    from training.trainer import DivergedError, run

    try:
        name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "tiny"
        run(cfg, config_name=name, stop=stop)
    except CommError as e:  # a peer died or hung: exit 3, which a launcher with restarts left restarts
        return _error(e, hang.annotate(str(e)), restart.EXIT_PEER)
    except (ConfigError, DataError, CheckpointError, LaunchError, RunLockError, DivergedError) as e:
        return _error(e)
    return 0


def _error(e: Exception, message: str = "", code: int = 2) -> int:
    """The job's one error line (rank 0's; another rank's only where rank 0 is the one stuck) and the exit code:
    2 for a refusal (bad setting, data, checkpoint), 3 for a failed collective (parallel/restart.py)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if rank == 0:
        print(f"error: {message or e}", file=sys.stderr, flush=True)
    elif 0 in (getattr(e, "absent", None) or []):  # rank 0 is stuck: the ranks that saw it speak
        print(f"error (rank {rank}): {message or e}", file=sys.stderr, flush=True)
    return code


def check_config_file(path: str) -> None:
    """The --config file must be a readable UTF-8 YAML mapping; anything else is one ConfigError naming it."""
    import yaml

    from config import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"--config {path} is a directory, not a YAML file")
    if not os.path.exists(path):
        return  # load_config names it: "config file not found"
    from config import check_config_size

    check_config_size(path)  # before reading it whole
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path} is not a text YAML file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise ConfigError(f"--config {path} cannot be read: {e.strerror}") from None
    if "\x00" in text:
        raise ConfigError(f"--config {path} is a binary file, not YAML")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path} is not valid YAML{where}: {problem}") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"--config {path} must be a mapping of sections (model:, train:, ...), "
                          f"not a {type(doc).__name__}")


def _exit(code: int) -> None:
    """Exit with ``code``. A rank of a distributed launch skips the interpreter's finalization: with gloo, a
    C++ transport thread still alive at static destruction can abort a run that ended cleanly ("terminate
    called without an active exception", SIGABRT, seen about once in ten 2-rank runs on a loaded machine),
    and the launcher then reports the whole job failed. Everything is closed by then (process groups,
    metrics, wandb, checkpoints); only the standard streams need flushing."""
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())

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
    from training.config import ConfigError, describe, load_config

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

    from data.indexed import DataError
    from parallel.launch import LaunchError
    from training.checkpoint import CheckpointError
    from training.trainer import run

    try:
        cfg = load_config(args.config, args.overrides)
        name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "tiny"
        run(cfg, config_name=name)
    except (ConfigError, DataError, CheckpointError, LaunchError) as e:
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

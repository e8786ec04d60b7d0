"""Typed experiment configuration.

Precedence: dataclass defaults < YAML file (``--config``) < command-line dotlist
(``train.max_steps=10 model.d_model=256``). Loading goes through omegaconf's
structured configs, so an unknown key or a value of the wrong type is rejected by
omegaconf itself; ``validate_config`` then checks the numbers against each other, and
``parallel/layout.py`` against the launch (world size, node size), before anything is built.

Every field carries a docstring; ``python train.py --help`` prints them.

  schema.py     the dataclasses, the ceilings of sizes and counts, the choices of string settings
  run.py        the run's own sections: data, checkpoint, logging (schema.py imports them into Config)
  moe.py, optimizer.py   the MoE and optimizers' sections; context.py: context parallelism's checks
  load.py       defaults < YAML < dotlist, and back to dict / YAML / --help lines
  validate.py   validate_config
  precision.py  what each precision computes in (fp8: by fp8.gemm)

The bottom layer: every package imports its settings from here, and this package imports nothing of the project.
"""
from config.load import check_config_size, describe, load_config, to_dict, to_yaml
from config.precision import compute_precision, fp8_operands, gemm_precision, grad_accumulation_precision
from config.schema import (CHOICES, HF_FAMILIES, MAX_AMAX_HISTORY, MAX_BUCKET_MB, MAX_CONFIG_BYTES, MAX_D_MODEL,
                           MAX_EVAL_ITERS, MAX_FP8_MARGIN, MAX_GLOBAL_BATCH, MAX_IN_FLIGHT, MAX_LAYERS,
                           MAX_LOSS_SCALE, MAX_MICRO_BATCH_TOKENS, MAX_QGZ_STAGES, MAX_QUANT_BLOCK, MAX_SEQ_LEN,
                           MAX_TIMEOUT_S, MAX_VOCAB_SIZE, MU_RANGE, CheckpointConfig, Config, ConfigError, DataConfig,
                           Fp8Config, LoggingConfig, LossScaleConfig, ModelConfig, ParallelConfig, TrainConfig,
                           ZeroConfig)
from config.run import WandbConfig
from config.validate import validate_config

__all__ = ["compute_precision", "fp8_operands", "gemm_precision", "grad_accumulation_precision", "check_config_size",
           "describe", "load_config", "to_dict", "to_yaml", "validate_config", "CHOICES", "HF_FAMILIES",
           "MAX_AMAX_HISTORY", "MAX_BUCKET_MB", "MAX_CONFIG_BYTES", "MAX_D_MODEL", "MAX_EVAL_ITERS", "MAX_FP8_MARGIN",
           "MAX_GLOBAL_BATCH", "MAX_IN_FLIGHT", "MAX_LAYERS", "MAX_LOSS_SCALE", "MAX_MICRO_BATCH_TOKENS",
           "MAX_QGZ_STAGES", "MAX_QUANT_BLOCK", "MAX_SEQ_LEN", "MAX_TIMEOUT_S", "MAX_VOCAB_SIZE", "MU_RANGE",
           "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Fp8Config", "LoggingConfig", "LossScaleConfig",
           "ModelConfig", "ParallelConfig", "TrainConfig", "WandbConfig", "ZeroConfig"]

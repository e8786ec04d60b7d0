"""``validate_config``: the checks that need no knowledge of the launch (choices, ranges, numbers against each
other), every problem one line, all reported at once."""
from __future__ import annotations

import math

from config.context import validate_context
from config.moe import validate_moe
from config.optimizer import validate_optimizer
from config.schema import (CHOICES, HF_FAMILIES, MAX_AMAX_HISTORY, MAX_BUCKET_MB, MAX_D_MODEL, MAX_EVAL_ITERS,
                           MAX_FP8_MARGIN, MAX_GLOBAL_BATCH, MAX_IN_FLIGHT, MAX_LAYERS, MAX_LOSS_SCALE,
                           MAX_MICRO_BATCH_TOKENS, MAX_QGZ_STAGES, MAX_QUANT_BLOCK, MAX_RESTARTS, MAX_SEQ_LEN,
                           MAX_TIMEOUT_S, MAX_VOCAB_SIZE, MU_RANGE, Config, ConfigError)


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _bound(x) -> str:
    """A range end for a message: an int as it is, a power of two beyond 2**±10 as 2**k, else %g."""
    if isinstance(x, int):
        return str(x)
    mantissa, exp = math.frexp(x)
    return f"2**{exp - 1}" if mantissa == 0.5 and abs(exp - 1) > 10 else f"{x:g}"


def validate_config(cfg: Config) -> None:
    """Checks that need no knowledge of the launch: choices, ranges, numbers against each other."""
    errors = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    def within(key: str, lo, hi, why: str) -> None:
        """One line when the value of ``key`` is outside [lo, hi] (or not a finite number)."""
        value = _get(cfg, key)
        need((isinstance(value, int) or math.isfinite(value)) and lo <= value <= hi,
             f"{key}={value} must be in [{_bound(lo)}, {_bound(hi)}] ({why})")

    for key, choices in CHOICES.items():
        need(_get(cfg, key) in choices, f"{key}={_get(cfg, key)!r} is not one of {list(choices)}")
    m, t = cfg.model, cfg.train
    for key in ("model.n_heads", "train.max_steps", "train.micro_batch_size",
                "parallel.tp", "parallel.pp", "parallel.virtual_stages", "logging.interval"):
        need(_get(cfg, key) >= 1, f"{key}={_get(cfg, key)} must be >= 1")
    within("model.n_layers", 1, MAX_LAYERS, "config.MAX_LAYERS")
    within("model.d_model", 1, MAX_D_MODEL, "config.MAX_D_MODEL")
    within("model.vocab_size", 1, MAX_VOCAB_SIZE, "config.MAX_VOCAB_SIZE")
    within("model.seq_len", 1, MAX_SEQ_LEN, "config.MAX_SEQ_LEN")
    if m.max_seq_len is not None:
        within("model.max_seq_len", 1, MAX_SEQ_LEN, "config.MAX_SEQ_LEN: the rotary table holds this many positions")
    within("train.global_batch_size", 1, MAX_GLOBAL_BATCH, "config.MAX_GLOBAL_BATCH sequences")
    need(t.micro_batch_size * m.seq_len <= MAX_MICRO_BATCH_TOKENS,
         f"train.micro_batch_size={t.micro_batch_size} x model.seq_len={m.seq_len} = "
         f"{t.micro_batch_size * m.seq_len} tokens per micro-batch exceeds {MAX_MICRO_BATCH_TOKENS} "
         f"(config.MAX_MICRO_BATCH_TOKENS)")
    if m.kv_channels is not None:
        within("model.kv_channels", 1, MAX_D_MODEL, "config.MAX_D_MODEL")
    if m.n_heads >= 1 and m.kv_channels is None:
        need(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads} "
             "(or set model.kv_channels)")
        need(m.head_dim % 2 == 0,
             f"head dim d_model/n_heads={m.d_model}/{m.n_heads} must be even for rotary embeddings")
    elif m.n_heads >= 1:
        need(m.head_dim % 2 == 0, f"model.kv_channels={m.kv_channels} must be even for rotary embeddings")
        need(m.q_size <= 4 * MAX_D_MODEL, f"model.n_heads x model.kv_channels = {m.q_size} exceeds "
             f"{4 * MAX_D_MODEL} (4 x config.MAX_D_MODEL)")
    if m.n_heads >= 1:
        if m.n_kv_heads is not None:
            need(1 <= m.n_kv_heads <= m.n_heads and m.n_heads % m.n_kv_heads == 0,
                 f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (each KV head serves "
                 f"the same number of query heads)")
    if m.rope_scaling != "none":
        need(math.isfinite(m.rope_scaling_factor) and m.rope_scaling_factor >= 1.0,
             f"model.rope_scaling_factor={m.rope_scaling_factor} must be a finite number >= 1 (a context "
             "extension factor)")
    if m.rope_scaling == "llama3":
        need(math.isfinite(m.rope_low_freq_factor) and math.isfinite(m.rope_high_freq_factor)
             and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
             f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
             f"{m.rope_high_freq_factor} must satisfy 0 < low < high (llama3 RoPE scaling)")
        within("model.rope_original_max_positions", 1, MAX_SEQ_LEN, "config.MAX_SEQ_LEN")
    need(m.hf_model_type in (None,) + HF_FAMILIES,
         f"model.hf_model_type={m.hf_model_type!r} is not one of {[None, *HF_FAMILIES]}")
    need(m.seq_len <= m.max_positions,
         f"model.seq_len={m.seq_len} exceeds the model's maximum model.max_seq_len={m.max_positions}")
    if m.ffn_hidden is not None:
        within("model.ffn_hidden", 1, 4 * MAX_D_MODEL, "4 x config.MAX_D_MODEL")
    for key in ("model.dropout", "model.attention_dropout"):
        need(0.0 <= _get(cfg, key) < 1.0, f"{key}={_get(cfg, key)} must be in [0, 1)")
    need(t.lr > 0, f"train.lr={t.lr} must be > 0")
    need(math.isfinite(t.lr), f"train.lr={t.lr} must be a finite number")
    need(math.isfinite(cfg.parallel.timeout_s) and 0 < cfg.parallel.timeout_s <= MAX_TIMEOUT_S,
         f"parallel.timeout_s={cfg.parallel.timeout_s} must be a finite number of seconds > 0 and <= "
         f"{MAX_TIMEOUT_S:g} (config.MAX_TIMEOUT_S, a week)")
    need(math.isfinite(cfg.parallel.bucket_mb) and 0 < cfg.parallel.bucket_mb <= MAX_BUCKET_MB,
         f"parallel.bucket_mb={cfg.parallel.bucket_mb} must be in (0, {_bound(MAX_BUCKET_MB)}] MiB "
         "(config.MAX_BUCKET_MB)")
    need(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    need(t.decay_steps is None or t.decay_steps > t.warmup_steps,
         f"train.decay_steps={t.decay_steps} must exceed train.warmup_steps={t.warmup_steps}")
    need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0")
    need(t.eval_interval >= 0, f"train.eval_interval={t.eval_interval} must be >= 0")
    within("train.eval_iters", 1, MAX_EVAL_ITERS, "config.MAX_EVAL_ITERS global batches per validation")
    need(t.micro_batch_size < 1 or t.global_batch_size % t.micro_batch_size == 0,
         f"train.global_batch_size={t.global_batch_size} is not divisible by "
         f"train.micro_batch_size={t.micro_batch_size}")
    within("train.max_restarts", 0, MAX_RESTARTS, "config.MAX_RESTARTS restarts inside one launch")
    need(math.isfinite(cfg.logging.straggler_factor) and (cfg.logging.straggler_factor == 0
                                                         or cfg.logging.straggler_factor > 1),
         f"logging.straggler_factor={cfg.logging.straggler_factor} must be 0 (off) or a finite factor > 1")
    c = cfg.checkpoint
    interval_ok = c.interval == "auto" or isinstance(c.interval, int) and not isinstance(c.interval, bool)
    need(interval_ok, f"checkpoint.interval={c.interval!r} must be a number of steps >= 0 or auto")
    need(not interval_ok or c.interval == "auto" or c.interval >= 0,
         f"checkpoint.interval={c.interval} must be >= 0 (0: only at exit) or auto")
    need(c.keep_last >= 1, f"checkpoint.keep_last={c.keep_last} must be >= 1")
    need(c.interval != "auto" or c.mtbf_hours is not None,
         "checkpoint.interval=auto needs checkpoint.mtbf_hours (the job's mean time between failures, in hours)")
    need(c.mtbf_hours is None or math.isfinite(c.mtbf_hours) and c.mtbf_hours > 0,
         f"checkpoint.mtbf_hours={c.mtbf_hours} must be a finite number of hours > 0")
    need(c.mtbf_hours is None or c.interval == "auto",
         f"checkpoint.mtbf_hours={c.mtbf_hours} is read only with checkpoint.interval=auto (got "
         f"checkpoint.interval={c.interval})")
    need(cfg.checkpoint.init_from is None or cfg.checkpoint.init_from.strip() != "",
         "checkpoint.init_from is empty: give a checkpoint path or leave it unset")
    need(not (cfg.checkpoint.init_from and cfg.checkpoint.load),
         f"checkpoint.init_from={cfg.checkpoint.init_from} and checkpoint.load={cfg.checkpoint.load} exclude each "
         "other: load resumes a run (optimizer and step), init_from starts one from weights only")
    need(cfg.loss_scale.initial >= cfg.loss_scale.min_scale > 0,
         f"loss_scale.initial={cfg.loss_scale.initial} must be >= loss_scale.min_scale={cfg.loss_scale.min_scale} > 0")
    need(not cfg.loss_scale.initial > MAX_LOSS_SCALE,  # nan: named by the line above
         f"loss_scale.initial={cfg.loss_scale.initial} must be <= {_bound(MAX_LOSS_SCALE)} (config.MAX_LOSS_SCALE; "
         f"every halving from a larger start is a skipped step)")
    need(cfg.loss_scale.growth_interval >= 1,
         f"loss_scale.growth_interval={cfg.loss_scale.growth_interval} must be >= 1")
    need(len(cfg.data.paths) >= 1, "data.paths is empty")
    need(cfg.data.weights is None or len(cfg.data.weights) == len(cfg.data.paths),
         f"data.weights has {len(cfg.data.weights or [])} entries but data.paths has {len(cfg.data.paths)}")
    need(len(cfg.data.split) == 2 and min(cfg.data.split) >= 0 and cfg.data.split[0] > 0,
         f"data.split={cfg.data.split} must be two non-negative fractions [train, valid] with train > 0")
    need(cfg.data.document_mask or not cfg.data.reset_position_ids,
         "data.reset_position_ids=true restarts positions at each document: it needs data.document_mask=true")
    z = cfg.zero
    need(z.stage in (0, 1, 2, 3), f"zero.stage={z.stage} is not one of [0, 1, 2, 3]")
    need(z.hpz_size >= 1, f"zero.hpz_size={z.hpz_size} must be >= 1")
    need(z.stage == 3 or z.hpz_size == 1, f"zero.hpz_size={z.hpz_size} needs zero.stage=3 (got zero.stage={z.stage})")
    for key in ("zero.quantized_weights", "zero.quantized_gradients"):
        need(z.stage >= 1 or not _get(cfg, key), f"{key}=true needs zero.stage 1, 2 or 3 (got zero.stage=0)")
    for key in ("zero.weight_bits", "zero.gradient_bits", "zero.gradient_bits_intra"):
        need(_get(cfg, key) in (4, 8) or key.endswith("_intra") and _get(cfg, key) is None,
             f"{key}={_get(cfg, key)} must be 4 or 8")
    need(not z.weight_delta or z.quantized_weights,
         "zero.weight_delta=true needs zero.quantized_weights=true (the differences travel at zero.weight_bits)")
    need(not (z.weight_delta and z.stage == 3 and z.hpz_size == 1),
         "zero.weight_delta=true at zero.stage=3 needs zero.hpz_size > 1 (hpZ's secondary shards hold the previous "
         "weights the differences apply to)")
    for key in ("zero.gradient_hadamard", "zero.gradient_bits_intra"):
        need(_get(cfg, key) in (False, None) or z.quantized_gradients,
             f"{key}={_get(cfg, key)} needs zero.quantized_gradients=true")
    need(2 <= z.quant_block <= MAX_QUANT_BLOCK and z.quant_block % 2 == 0,
         f"zero.quant_block={z.quant_block} must be an even number in [2, {MAX_QUANT_BLOCK}] (config.MAX_QUANT_BLOCK)")
    need(not z.gradient_hadamard or z.quant_block & (z.quant_block - 1) == 0,
         f"zero.gradient_hadamard=true needs zero.quant_block to be a power of two (got {z.quant_block}): the "
         f"Hadamard transform rotates whole blocks")
    within("zero.qgz_stages", 1, MAX_QGZ_STAGES, "config.MAX_QGZ_STAGES")
    within("zero.prefetch_depth", 1, MAX_IN_FLIGHT, "config.MAX_IN_FLIGHT; zero.prefetch=false turns prefetching off")
    within("zero.reduce_in_flight", 1, MAX_IN_FLIGHT, "config.MAX_IN_FLIGHT")
    need(z.qgz_min_numel >= 0, f"zero.qgz_min_numel={z.qgz_min_numel} must be >= 0")
    need(z.quant_error_interval >= 0, f"zero.quant_error_interval={z.quant_error_interval} must be >= 0")
    need(z.quant_error_interval == 0 or z.quantized_weights or z.quantized_gradients,
         f"zero.quant_error_interval={z.quant_error_interval} needs zero.quantized_weights or "
         f"zero.quantized_gradients (nothing is quantized)")
    validate_optimizer(cfg, need)
    validate_moe(cfg, need)
    validate_context(cfg, need)
    f = cfg.fp8
    within("fp8.amax_history_len", 1, MAX_AMAX_HISTORY, "config.MAX_AMAX_HISTORY steps")
    within("fp8.margin", 0, MAX_FP8_MARGIN, "config.MAX_FP8_MARGIN: a larger one flushes every value to zero")
    within("fp8.mu_initial", MU_RANGE[0], MU_RANGE[1], "config.MU_RANGE, the range mu's auto-scaling keeps it in")
    need(0 <= f.mu_overflow_threshold < 1, f"fp8.mu_overflow_threshold={f.mu_overflow_threshold} must be in [0, 1)")
    need(f.mu_growth_interval >= 1, f"fp8.mu_growth_interval={f.mu_growth_interval} must be >= 1")
    need(not (f.emulate and f.gemm == "fp8"), "fp8.emulate=true emulates FP8 numerics around 16-bit GEMMs: it does "
         "not combine with fp8.gemm=fp8 (use fp8.gemm=auto, bf16 or fp16 with it, or fp8.emulate=false)")
    if cfg.precision == "fp8":
        need(not (m.tie_embeddings and cfg.parallel.pp > 1),
             "precision=fp8 with model.tie_embeddings=true and parallel.pp > 1 is not supported (the tied "
             "embedding's FP8 gradients would be summed across stages); untie the embeddings or use pp=1")
        for key in ("zero.quantized_weights", "zero.quantized_gradients"):
            need(not _get(cfg, key), f"{key}=true does not combine with precision=fp8: FP8-LM already moves "
                                     f"{'weights' if 'weights' in key else 'gradients'} in FP8 (hpZ does combine)")
    if errors:
        raise ConfigError.listing("invalid configuration", errors)

"""The typed schema: one dataclass per section, a docstring per field, the ceilings validation checks and the
choices of every string setting (the optimizers' sections: ``optimizer.py``; data, checkpoint and logging:
``run.py``). Imports nothing of the project outside ``config``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from config.moe import MOE_SCORES, MoeConfig
from config.optimizer import MUON_ADJUST_LR, OPTIMIZERS, AdafactorConfig, Adamw8bitConfig, MuonConfig
from config.run import CheckpointConfig, DataConfig, LoggingConfig


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent."""

    problems: Tuple[str, ...] = ()
    """Each problem on its own, when the error lists the findings of several checks (``ConfigError.listing``)."""

    @classmethod
    def listing(cls, header: str, problems: Sequence[str]) -> "ConfigError":
        """The error of checks that found ``problems``: ``header: problem`` on one line when one value is wrong;
        the header, then one ``  - problem`` line each, when several are."""
        text = f"{header}: {problems[0]}" if len(problems) == 1 else f"{header}:\n  - " + "\n  - ".join(problems)
        error = cls(text)
        error.problems = tuple(problems)
        return error


# Ceilings of the sizes, counts and intervals that allocate or loop (``validate_config`` checks each, one line
# per field). Each sits one or more orders of magnitude above any published configuration, so only a typo or a
# unit mistake reaches one -- which would otherwise pass validation and die later in an allocation traceback,
# a near-endless loop, or a run whose every step is skipped.
MAX_SEQ_LEN = 2**20
"""model.seq_len and model.max_seq_len (the rotary table's positions; also the ceiling of an imported model's
max_position_embeddings): 1M tokens, 8x Llama 3.1's 128k. Without context parallelism one rank's attention holds
the whole sequence, and the table alone is 0.5 GiB at head_dim 128."""
MAX_VOCAB_SIZE = 2**22
"""model.vocab_size: 16x the largest published vocabulary (about 256k)."""
MAX_D_MODEL = 2**17
"""model.d_model: 6x the widest published dense model (20,480); model.ffn_hidden is bounded by 4x this."""
MAX_LAYERS = 2**12
"""model.n_layers: 4x the deepest Transformer trained (DeepNet, 1,000 layers); GPTs have <= 128."""
MAX_GLOBAL_BATCH = 2**20
"""train.global_batch_size, in sequences: 16x the largest published batch (LAMB's 65,536)."""
MAX_MICRO_BATCH_TOKENS = 2**24
"""train.micro_batch_size x model.seq_len: tokens one rank holds activations for at once (real runs: <= 2**17)."""
MAX_EVAL_ITERS = 2**16
"""train.eval_iters: global batches per validation (Megatron's default is 100)."""
MAX_AMAX_HISTORY = 2**16
"""fp8.amax_history_len: 64x Transformer Engine's default (1024); one fp32 each per FP8 tensor."""
MAX_FP8_MARGIN = 32
"""fp8.margin: E5M2 spans 2**-16 .. 2**15.8, so a larger margin flushes every value of both formats to zero."""
MU_RANGE = (2.0**-64, 2.0**64)
"""fp8.mu_initial: the range fp8.grad_comm.AutoScale keeps mu in (mu * g must stay finite in fp32)."""
MAX_LOSS_SCALE = 2.0**64
"""loss_scale.initial: 2**32 times Megatron's default initial scale (2**32); each halving costs a skipped step."""
MAX_QUANT_BLOCK = 2**16
"""zero.quant_block: 512x the default (128); every qgZ shard is zero-padded to a multiple of
quant_block x qgz_stages."""
MAX_QGZ_STAGES = 64
"""zero.qgz_stages: chunks a qgZ reduce is pipelined in (ZeRO++ uses a handful), one all-to-all pair each."""
MAX_IN_FLIGHT = 64
"""zero.prefetch_depth, zero.reduce_in_flight: more modules than any model has units in one pipeline stage
would never be reached; each one in flight holds a unit's full buffer."""
MAX_BUCKET_MB = 2.0**20
"""parallel.bucket_mb: 1 TiB, larger than any model's gradients (a bucket never exceeds them)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# restarts of a group inside one launch (train.max_restarts): Llama 3 saw 419 interruptions in 54 days on 16K GPUs
MAX_RESTARTS = 10_000
"""parallel.timeout_s: a week; a collective stuck longer is a hang (and ~1e9 s overflows C++ clocks)."""
MAX_CONFIG_BYTES = 4 * 2**20
"""A --config YAML file: 4 MiB, about a thousand times the largest preset (a blend of thousands of data.paths
included); a larger file is refused before it is parsed (300 MB took YAML about two minutes)."""


@dataclass
class ModelConfig:
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Hidden size."""
    n_heads: int = 4
    """Attention heads; d_model must be divisible by it."""
    n_kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention); default n_heads (multi-head attention). Must divide
    n_heads; split over TP when divisible by parallel.tp, else replicated (parallel.tp a multiple of it)."""
    seq_len: int = 128
    """Training sequence length in tokens (at most MAX_SEQ_LEN = 2**20)."""
    max_seq_len: Optional[int] = None
    """The model's maximum sequence length (rotary table size); defaults to seq_len; at most MAX_SEQ_LEN = 2**20."""
    vocab_size: int = 4096
    """Embedding rows (padded vocabulary); must cover the tokenizer's vocabulary."""
    ffn_hidden: Optional[int] = None
    """MLP hidden size; default 4*d_model for gelu, 8/3*d_model rounded up to 64 for swiglu."""
    activation: str = "swiglu"
    """MLP type: swiglu | gelu."""
    norm: str = "rmsnorm"
    """Normalisation: rmsnorm | layernorm."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    rope_theta: float = 10000.0
    """Rotary position embedding base."""
    rope_scaling: str = "none"
    """RoPE frequency scaling for a longer context: none | linear (every frequency / rope_scaling_factor) |
    llama3 (Llama 3.1/3.2: low frequencies / factor, high ones kept, a smooth ramp between)."""
    rope_scaling_factor: float = 1.0
    """linear and llama3: the context extension factor (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above rope_original_max_positions / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below rope_original_max_positions / this are kept; must exceed rope_low_freq_factor."""
    rope_original_max_positions: int = 8192
    """llama3: the context length the model was pretrained at before the extension."""
    kv_channels: Optional[int] = None
    """Per-head dimension (Megatron's kv_channels, Hugging Face's head_dim); default d_model / n_heads. The query
    and output projections are n_heads * kv_channels wide."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    bias: bool = False
    """Use biases in linear layers (GPT-2 style)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2; Megatron's add_qkv_bias); model.bias already
    puts one on every linear layer."""
    dropout: float = 0.0
    """Dropout on embeddings and on each residual branch."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections use init_std/sqrt(2*n_layers)."""
    activation_checkpointing: str = "off"
    """Recompute activations in backward: off | full (every block) | selective (attention core)."""
    qk_norm: bool = False
    """RMSNorm (model.norm_eps, a learned [head_dim] weight each) on every head's queries and keys before RoPE
    (Qwen3, OLMo 2's per-head form)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture of experts (config/moe.py): routed experts in place of the MLP of some layers; 0 experts = dense."""
    hf_model_type: Optional[str] = None
    """The Hugging Face architecture scripts/export_hf.py writes: llama | qwen2 | mistral | qwen3 | mixtral |
    qwen2_moe | qwen3_moe; null: inferred from the model (model/hf/families.py: experts give qwen3_moe with QK-norm,
    qwen2_moe with shared experts, else mixtral; QK-norm alone qwen3; q/k/v biases only qwen2; else llama). Set by
    scripts/import_hf.py; the computation depends on the other model keys only."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.d_model // self.n_heads

    @property
    def q_size(self) -> int:
        """Output features of the query projection (= input features of the attention's output projection)."""
        return self.n_heads * self.head_dim

    @property
    def attn_bias(self) -> bool:
        """Whether the query/key/value projections have biases (model.bias or model.qkv_bias)."""
        return self.bias or self.qkv_bias

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation == "swiglu":
            return -(-int(8 * self.d_model / 3) // 64) * 64
        return 4 * self.d_model

    @property
    def max_positions(self) -> int:
        return self.max_seq_len if self.max_seq_len is not None else self.seq_len


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (innermost, must stay inside a node)."""
    pp: int = 1
    """Pipeline-parallel size (outermost)."""
    sequence_parallel: bool = False
    """Split norm/dropout/residual regions along the sequence across the TP group."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    ep: int = 1
    """Expert-parallel size (Megatron's expert_model_parallel_size): each group of ep consecutive data-parallel
    ranks splits every MoE layer's routed experts (model.moe.num_experts / ep each) and exchanges tokens with
    all-to-alls; must divide the data-parallel size. Expert gradients are summed over the dp / ep ranks holding
    the same experts (the expert-data-parallel group). 1 = every rank holds every expert."""
    cp: int = 1
    """Context-parallel size (Megatron's context_parallel_size): each sequence is cut into 2 x cp chunks and every
    rank of a CP group holds two of them (chunks r and 2cp - 1 - r: causal attention's work balanced), so
    activations per rank fall as 1 / cp. World = pp x dp x cp x tp: the cp ranks of a group are consecutive after
    the TP ones (inside a node when tp x cp <= ranks_per_node). Parameters are replicated over CP as over DP:
    gradients, ZeRO shards and FP8 scales span the dp x cp ranks. model.seq_len must be divisible by 2 x cp."""
    cp_comm: str = "p2p"
    """How attention sees the other CP ranks' keys and values: p2p (ring attention: K/V blocks passed around the CP
    ring, overlapped with the attention of the block in hand) | all_gather (Llama 3's: gather K/V, attend locally) |
    a2a (DeepSpeed-Ulysses: an all-to-all gives each rank the whole sequence of heads / cp of the heads, attention
    runs as without CP, another all-to-all returns its output; the heads on each TP rank must divide by cp, KV
    heads are replicated where CP ranks' query heads share one: parallel/ulysses.py)."""
    ranks_per_node: Optional[int] = None
    """Ranks per node; default from the launcher (LOCAL_WORLD_SIZE / SLURM). Lets one machine simulate nodes."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size for data parallelism, in MiB (> 0, at most 2**20)."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's all-reduce as soon as it is ready during backward."""
    timeout_s: float = 600.0
    """Collective timeout in seconds (at most a week); a stuck or dead peer fails the job after this long."""


@dataclass
class ZeroConfig:
    stage: int = 0
    """ZeRO stage over each data-parallel group: 0 = plain DP, 1 = shard optimizer states, 2 = also gradients,
    3 = also parameters (gathered per block before use, released after)."""
    partition: str = "flat"
    """How shards are cut: flat (equal contiguous pieces of each block's flat buffer) | whole_tensor (every tensor
    whole on one rank, largest first to the least-loaded rank; what FP8-LM's per-tensor scales need)."""
    reduce_dtype: str = "compute"
    """Stages 1-3: dtype in which gradients accumulate and are reduce-scattered: compute (the precision's dtype, as
    Megatron-core and FSDP2 do) | fp32."""
    prefetch: bool = True
    """Stage 3: gather the next modules' parameters while the current one computes (no effect below stage 3)."""
    prefetch_depth: int = 2
    """Stage 3 with zero.prefetch: how many modules ahead (forward) or behind (backward) are gathered while one
    computes; the optimizer step starts the gathers of the next forward's first depth + 1 modules. Deeper covers a
    slower link; each module ahead holds its gathered parameters (training/memory.py counts them in the working
    peak)."""
    reduce_in_flight: int = 2
    """Stages 2-3: gradient reduce-scatters (or qgZ reduces) allowed in flight while backward continues; each
    holds its unit's full gradient buffer until it arrives (counted in the working peak)."""
    early_step: bool = True
    """Stage 3 with hpZ (zero.hpz_size > 1) and qwZ, without qWD: step each unit's optimizer shard (but the first
    module's) as soon as its gradient shard is final in the step's last backward, assuming the gradient clip
    will not bite (nor the loss scale find an overflow), and gather the updated weights across nodes into the
    hpZ secondary shards while backward goes on, so the next forward gathers them inside the node. Exact: when
    the global norm arrives and the clip (or an overflow) does bite, the early work is thrown away and the step
    runs as without this; a step that follows a clipped one does not try. No effect elsewhere
    (parallel/zero/sharded.py)."""
    quantized_weights: bool = False
    """ZeRO++ qwZ: all-gather weights blockwise-quantized to zero.weight_bits, dequantized on arrival (stage 3:
    every gather from the primary shards; stages 1-2: the post-step all-gather of the updated parameters); the
    persistent shard and the master weights are never quantized."""
    weight_bits: int = 8
    """qwZ bits per weight: 8 | 4."""
    weight_delta: bool = False
    """qWD (SDP4Bit) with zero.quantized_weights: a gather sends the zero.weight_bits-quantized difference between
    the new weights and the copy every receiver reconstructed last time (not the weights), and receivers add it
    to that copy, so quantization error does not accumulate. Stages 1-2: the post-step all-gather (every rank
    holds the previous weights). Stage 3: needs hpZ (zero.hpz_size > 1), whose secondary shards hold the
    previous weights. The first gather of a run, and the first after a resume from a checkpoint without the
    reconstructed copy, is exact (unquantized, compute dtype); a checkpoint of a qWD run keeps the copy, so a
    resume continues bit for bit."""
    hpz_size: int = 1
    """ZeRO++ hpZ (stage 3): keep a secondary copy of each block's gathered weights sharded over this many DP ranks
    of one node, so backward (and later micro-batches) gather inside the node; 1 = off. Must divide the DP ranks
    per node; costs (parameters / hpz_size) extra memory per rank."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (stages 1-3): reduce-scatter gradients by quantized hierarchical all-to-all (intra-node, then
    inter-node, fp32 sums, one division by the DP size). A block whose gradient buffer has fewer than
    zero.qgz_min_numel elements takes the plain reduce-scatter instead."""
    gradient_bits: int = 4
    """qgZ bits per gradient across nodes (the inter-node hop; the whole reduce where a node holds one DP rank):
    4 | 8."""
    gradient_bits_intra: Optional[int] = None
    """qgZ bits of the intra-node hop: 4 | 8; null = zero.gradient_bits. SDP4Bit's two-level setting is 8 here
    and 4 across nodes."""
    gradient_hadamard: bool = False
    """qgZ: rotate every quantization block by a seeded random-sign Hadamard transform before quantizing (and
    back after the reduce), spreading outliers over the block; zero.quant_block must be a power of two."""
    quant_block: int = 128
    """qwZ / qgZ quantization block: consecutive values sharing one fp32 scale (even, 2 to 2**16)."""
    qgz_stages: int = 2
    """qgZ pipeline stages: the buffer is cut in this many chunks so the intra- and inter-node hops overlap
    (1 to 64)."""
    qgz_min_numel: int = 4096
    """qgZ size threshold (elements of a block's padded gradient buffer): smaller buffers take the plain
    reduce-scatter, by rule, in the trainer and in the analytic byte counts alike."""
    quant_error_interval: int = 0
    """Every this many steps, log the relative error qwZ / qgZ introduced (gathered weights vs their shards;
    reduced gradients vs an extra unquantized reduce-scatter, whose bytes are counted); 0 = off."""


@dataclass
class Fp8Config:
    """FP8-LM (``precision=fp8``): FP8 GEMMs, FP8 gradients with the auto-scaling factor mu, FP8 AdamW."""

    backend: str = "torch"
    """FP8 GEMMs through torch._scaled_mm (CPU and compute capability >= 8.9) | te (Transformer Engine: not
    implemented; refused at start-up with a clear error, whether or not it is installed)."""
    scaling: str = "delayed"
    """Per-tensor scales of activations, weights and output gradients: delayed (from an amax history, reduced
    over TP and DP once per step) | current (from the tensor itself, its amax reduced over TP first)."""
    amax_history_len: int = 16
    """Delayed scaling: steps of amax history kept per tensor (1 to 2**16)."""
    amax_compute: str = "max"
    """Delayed scaling: max (of the history) | most_recent."""
    margin: int = 0
    """Scales are max(format) / amax / 2**margin (0 to 32)."""
    power_of_two_scales: bool = False
    """Round activation/weight/gradient scales down to a power of two."""
    gradient_format: str = "e5m2"
    """Format of output gradients in the GEMMs and of the communicated weight gradients: e5m2 | e4m3."""
    output_head: bool = False
    """Run the output head's GEMMs in FP8 too (default: bf16, like the embedding, norms and attention core)."""
    sequence_parallel_fp8: bool = True
    """With sequence parallelism, cast activations to E4M3 before the all-gather (half the bytes of bf16)."""
    cast_transpose: bool = False
    """The backward GEMMs' FP8 operands (the output gradient with its transpose, the saved input's transpose) made
    by the Triton kernels of kernels/fp8_transpose.py (Transformer Engine's cast_transpose) instead of torch ops
    that inductor fuses; the same bytes (tested). CPU runs the same plain-torch operations either way. Off until
    a GPU run has timed it."""
    gemm: str = "auto"
    """The dtype of the linear layers' GEMMs: auto (fp8 where the device has FP8 tensor cores, compute capability
    >= 8.9, and on CPU; bf16 on 8.0-8.8, A100; fp16 below, V100: decided by capability, never by the GPU's name) |
    fp8 | bf16 | fp16. With bf16 or fp16 GEMMs the weights enter them as the step's 16-bit working copy and the
    activations are not quantized; the rest of FP8-LM is unchanged (FP8 weight gradients with mu and their FP8
    communication, the FP8 AdamW and its 6 bytes a parameter, whole-tensor ZeRO, hpZ). fp16 GEMMs compute the
    whole model in fp16 under the dynamic loss scaler (loss_scale.*)."""
    emulate: bool = False
    """FP8 numerics around 16-bit GEMMs: every GEMM operand cast to FP8 with its scale and dequantized into the
    GEMM's dtype (fp8.gemm: bf16 or fp16; auto picks the device's 16-bit one). Tests FP8-LM's numerics where
    there are no FP8 tensor cores; no speed-up. Refused with fp8.gemm=fp8."""
    mu_initial: float = 1.0
    """Gradient auto-scaling factor mu at the start (FP8-LM 2.1); 2**-64 to 2**64, the range mu moves in."""
    mu_overflow_threshold: float = 1e-5
    """Halve mu when more than this fraction (1e-5 = 0.001 %) of the reduced FP8 gradient hits the format max."""
    mu_growth_interval: int = 1000
    """Double mu after this many consecutive steps under the threshold."""
    master_dtype: str = "fp16"
    """FP8 AdamW master weights: fp16 (with a per-tensor scale; 6 bytes a parameter of model state) | fp32."""
    grad_accumulation: str = "compute"
    """Where a step's weight gradients add up over its micro-batches before their FP8 cast: compute (the compute
    dtype's 16 bits: bf16, or fp16 with fp8.gemm=fp16, where a V100 has no bf16) | bf16 (2 bytes a parameter while
    a step runs; each sum rounded to bf16's 8 bits, far below the E5M2 cast's 3 that follows) | fp16 (2 bytes;
    loss-scaled fp16 sums that overflow skip the step like any fp16 overflow) | fp32 (4 bytes, Megatron's
    main_grad)."""


@dataclass
class TrainConfig:
    max_steps: int = 200
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks (gradient accumulation fills the gap)."""
    seed: int = 1234
    """Seed of initialisation, data order and dropout."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of the peak."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    decay_steps: Optional[int] = None
    """Steps from the start to the end of the cosine decay; default max_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    eval_interval: int = 50
    """Run validation every this many steps (0 = never)."""
    eval_iters: int = 4
    """Global batches per validation (1 to 2**16)."""
    max_restarts: int = 0
    """When a rank dies, restart the whole group inside the same launch (same nodes), resuming from the newest
    checkpoint, at most this many times; 0 = a dead rank ends the job (and SLURM's requeue, if any, takes over).
    Who restarts (parallel/restart.py): `python train.py` supervises its trainer itself; scripts/slurm/train.sbatch
    runs srun again; under torchrun its --max-restarts decides. Exit 2 (a refusal) is never restarted."""
    time_limit_minutes: Optional[float] = None
    """Stop (saving a checkpoint) once this much wall-clock time has passed."""
    optimizer: str = "adamw"
    """adamw | adafactor | adamw8bit | muon (Muon for the blocks' matrices, AdamW for the rest): each one's settings
    are under train.<name>, AdamW's are train.beta1, beta2, eps and weight_decay (Muon's AdamW part and 8-bit AdamW
    use them too)."""
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    adamw8bit: Adamw8bitConfig = field(default_factory=Adamw8bitConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    compile: Optional[bool] = None
    """torch.compile each transformer block and the loss (model/compile.py): null = on for CUDA, off for CPU (where
    inductor's C++ build costs more than it saves on a short run); true | false force it."""


@dataclass
class LossScaleConfig:
    initial: float = 65536.0
    """Starting loss scale for fp16 (at most 2**64)."""
    growth_interval: int = 1000
    """Double the scale after this many steps without inf/nan (>= 1)."""
    min_scale: float = 1.0
    """Never halve below this; reaching it with overflow is an error."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: str = "fp32"
    """fp32 | bf16 | fp16 (dynamic loss scaling) | fp8 (FP8-LM: FP8 gradients and AdamW, GEMMs per fp8.gemm; bf16
    elsewhere, fp16 with fp16 GEMMs)."""
    device: str = "auto"
    """auto (cuda when present) | cpu | cuda."""


HF_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
"""model.hf_model_type's values: the Hugging Face architectures model/hf.py maps to and from."""

CHOICES = {
    # the values each string setting takes (validate.py checks them; load.py reads YAML's booleans against them)
    "model.activation": ("swiglu", "gelu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.rope_scaling": ("none", "linear", "llama3"),
    "model.activation_checkpointing": ("off", "full", "selective"),
    "model.moe.score": MOE_SCORES,
    "precision": ("fp32", "bf16", "fp16", "fp8"),
    "train.optimizer": OPTIMIZERS,
    "train.muon.adjust_lr": MUON_ADJUST_LR,
    "device": ("auto", "cpu", "cuda"),
    "logging.wandb.mode": ("online", "offline", "disabled"),
    "parallel.cp_comm": ("p2p", "all_gather", "a2a"),
    "zero.partition": ("flat", "whole_tensor"),
    "zero.reduce_dtype": ("compute", "fp32"),
    "checkpoint.on_data_change": ("error", "warn"),
    "fp8.backend": ("torch", "te"),
    "fp8.scaling": ("delayed", "current"),
    "fp8.amax_compute": ("max", "most_recent"),
    "fp8.gradient_format": ("e5m2", "e4m3"),
    "fp8.master_dtype": ("fp16", "fp32"),
    "fp8.grad_accumulation": ("compute", "bf16", "fp16", "fp32"),
    "fp8.gemm": ("auto", "fp8", "bf16", "fp16"),
}

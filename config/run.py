"""The run's own sections: the data it reads, the checkpoints it writes and resumes from, its logging (split from
``schema.py``, which imports them into ``Config``). Imports nothing of the project outside ``config``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union


@dataclass
class DataConfig:
    paths: List[str] = field(default_factory=lambda: ["data/sample/sample_text_document"])
    """Prefixes of preprocessed .bin/.idx pairs."""
    weights: Optional[List[float]] = None
    """Blending weights, one per path (default: equal)."""
    split: List[float] = field(default_factory=lambda: [0.95, 0.05])
    """Train/validation fractions of each dataset's documents."""
    tokenizer: str = "data/sample/tokenizer.model"
    """Tokenizer used to build the data: a sentencepiece .model, a Hugging Face tokenizer.json, or a directory holding
    one (tokenizer.json first, else tokenizer.model). Its vocabulary bounds model.vocab_size; data whose .idx records
    another tokenizer is refused."""
    document_mask: bool = False
    """Each token attends only to the earlier tokens of its own document (Llama 3's mask; Megatron's
    --reset-attention-mask): documents end with the tokenizer's EOD id, which the data must hold (checked at start)
    and whose own loss (predicting the next document's first token) is kept. Off: causal attention over the whole
    sample, across its documents."""
    reset_position_ids: bool = False
    """With data.document_mask: rotary positions restart at 0 at each document's first token (Megatron's
    --reset-position-ids)."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory; default <logging.run_dir>/checkpoints. Resumes from its newest valid checkpoint."""
    interval: Union[int, str] = 100
    """Save every this many steps (0 = only at exit), or auto: the Young/Daly interval sqrt(2 x save stall x
    checkpoint.mtbf_hours) from the measured save stall and step time, chosen again after every save (the first save
    comes after the second step; one line says what it chose and why)."""
    mtbf_hours: Optional[float] = None
    """Mean time between failures of the whole job, in hours (e.g. a node's MTBF / the nodes); needed by, and only
    read with, checkpoint.interval=auto."""
    async_save: bool = False
    """Asynchronous saves: the step that saves copies the state to CPU (pinned under CUDA; one more copy of the state
    per rank, kept between saves) and a background writer writes, hashes and publishes it while training goes on;
    same files, manifest and publish-by-rename as a synchronous save, at most one save in flight, the final save
    waited for. (``async`` is a Python keyword: it cannot name a field.)"""
    keep_last: int = 2
    """Keep this many newest checkpoints."""
    resume: bool = True
    """Resume from the newest valid checkpoint in dir when there is one."""
    load: Optional[str] = None
    """Start from this checkpoint directory instead (e.g. another run's); must be valid."""
    init_from: Optional[str] = None
    """Initialise the model weights from this checkpoint (a checkpoint, a checkpoint root or a run directory; e.g.
    the output of scripts/import_hf.py), at step 0 with a fresh optimizer, in any layout. Ignored when dir holds a
    checkpoint to resume from (a requeued job resumes its own progress). Its model settings must equal the run's,
    except the rotary ones and the MoE router's (no weight depends on them; a change is named on one line)."""
    save_at_exit: bool = True
    """Save when the run ends (max steps, time limit or SIGTERM/SIGUSR1)."""
    allow_fresh_start: bool = False
    """Start from step 0 even though dir holds checkpoints that cannot be used (corrupted, quarantined as
    *.corrupt-*, or a 'latest' naming a missing one). Off: such a run stops with an error instead of
    silently training from scratch over them; the unusable ones are then renamed aside, never deleted."""
    on_data_change: str = "error"
    """When a resumed run's data (file contents, split, weights, data order), train.seed or model.seq_len differ
    from the checkpoint's fingerprint: error (refuse to start) | warn (print a warning and continue)."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """online | offline | disabled."""
    project: str = "gpt-pretrain"
    """wandb project."""
    name: Optional[str] = None
    """Run name; default the run directory's name."""
    entity: Optional[str] = None
    """wandb entity (team)."""


@dataclass
class LoggingConfig:
    run_dir: Optional[str] = None
    """Where metrics.jsonl, wandb files and (by default) checkpoints go; default runs/<config>-<time>."""
    interval: int = 10
    """Log training metrics every this many steps."""
    straggler_factor: float = 1.5
    """Every logging.interval the slowest rank's step time is logged against the median of all ranks'; a rank whose
    step time stays above this factor of the median is named in one warning line (0 = no warning)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)

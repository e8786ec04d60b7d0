"""Training: the step, the loop and what persists between runs. Second layer from the top: it may import
every package below (config/, data/, kernels/, parallel/, fp8/, model/); only train.py and scripts/
import it.

  engine.py      one optimizer step: pipeline schedule, the data-parallel strategy, loss scaling
  trainer.py     the loop: data, validation, logging, checkpoints, stop signals, divergence
  checkpoint.py  torch.distributed.checkpoint, layout-independent, atomic, verified
  checkpoint_files.py  a checkpoint's manifest, its verification, finding the checkpoint a path names
  safe_load.py   reading a checkpoint's files without running anything in them (allow-list unpickler)
  optim.py       warm-up + cosine learning rate, dynamic loss scaling
  memory.py      the per-rank memory estimate (model states by ZeRO stage, activations)
  metrics.py     metrics.jsonl, console, wandb; MFU
  run_lock.py    one trainer per run directory
  stop.py        SIGTERM / SIGUSR1 turned into a clean stop at a step boundary
"""

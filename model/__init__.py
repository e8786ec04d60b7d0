"""The GPT, built from the parallel-aware layers of parallel/ (and fp8/'s linear through them).

Middle layer: imports config/ and the parallel primitives and layers, never the data-parallel strategies,
training/ or the entry points (like nanoGPT's model, it knows nothing of the trainer).

  gpt.py     chunks of blocks per pipeline stage, embedding and head, named parameters
  layers.py  attention (SDPA, grouped-query), MLP, norms, the block; TP/SP context
  init.py    every parameter drawn whole from a generator seeded by its global name
  flops.py   parameter count and FLOPs per token
  hf/        the mapping to and from Hugging Face (settings, config.json, tensor names)
"""

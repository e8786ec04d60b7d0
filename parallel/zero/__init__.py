"""ZeRO over each data-parallel group (stages 1-3; ZeRO++ builds on these).

A strategies-layer package: it may import config/, kernels/, the parallel primitives and layers, fp8/
numerics and model/ (units are cut along the model's modules); never training/ or the entry points.
fp8/zero.py (FP8-LM's strategy) builds on sharded.py from beside it.

  partition.py   which DP rank owns which elements of a unit's flat buffer: flat | whole_tensor
  units.py       the units (embedding, each block, final norm, head) and which modules use them
  sharded.py     the strategy: gradient reduce-scatter, clip, AdamW on shards, post-step gathers (+ the 3 mixins below)
  buffers.py     a unit's flat buffers on this rank (Unit) and the working-set bytes (Working)
  gathers.py     stage 3's gather / release / prefetch hooks and hpZ secondary shards (a mixin of sharded.py's strategy)
  early_step.py  zero.early_step: step a unit's shard as its gradient lands, gather it into the hpZ shards (a mixin)
  sharded_state.py  checkpoint state (global tensors), load, unsharded gradients, memory accounting (a mixin)
  zeropp.py      qwZ quantized gather, qgZ two-hop quantized reduce, their byte counts (kernels in kernels/)
  adamw.py       AdamW on flat fp32 shards (torch.optim.AdamW's arithmetic)
  dcp_view.py    shards as boxes of global tensors, for torch.distributed.checkpoint
"""

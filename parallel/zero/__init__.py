"""ZeRO over each data-parallel group (stages 1-3; ZeRO++ builds on these).

  partition.py   which DP rank owns which elements of a unit's flat buffer: flat | whole_tensor
  units.py       the units (embedding, each block, final norm, head) and which modules use them
  sharded.py     the strategy: gradient reduce-scatter, AdamW on shards, stage-3 gather / release / prefetch
  adamw.py       AdamW on flat fp32 shards (torch.optim.AdamW's arithmetic)
  dcp_view.py    shards as boxes of global tensors, for torch.distributed.checkpoint
"""

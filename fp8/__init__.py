"""FP8-LM mixed precision (SPEC §4, seed 001).

Two layers live here. The numerics sit below model/ (beside the parallel primitives, whose comm they use for
amax and gradient reductions; the TP linears call the FP8 GEMM):

  format.py      E4M3 / E5M2, amax, scale from amax, scaled casts
  segments.py    per-tensor spread / max / sum over tensors stored back to back (whole-unit operations)
  scaling.py     delayed / current scaling state and amax histories, reduced over their groups
  linear.py      the FP8 linear (torch._scaled_mm) with its autograd
  experts.py     the routed experts' FP8 GEMMs, each expert on its rows (one scaling state a stacked projection)
  grad_comm.py   FP8 gradient all-reduce / reduce-scatter with the auto-scaling factor mu
  adam.py        AdamW with an FP8 first moment and FP16 second moment
  device.py      the capability check (compute capability, never the device name)

They import config/ and parallel/comm.py only. One strategy (four files) sits above model/, with the other data-parallel
strategies:

  zero.py        FP8-LM data parallelism for ZeRO 0-3: whole-tensor ownership, FP8 reduction, FP8 AdamW
  zero_unit.py   one unit's FP8-LM state on a rank, its owners, and the whole-unit (packed) updates
  zero_checkpoint.py  its checkpoints: masters and moments as fp32 under the global names, mu's state
  zero_weights.py  its weights: E4M3 copies after the step, 16-bit working weights, stage 0's casts from the masters

It may import everything below training/. Nothing here imports training/.
"""

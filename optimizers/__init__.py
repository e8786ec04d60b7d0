"""Optimizers other than AdamW, tensor by tensor (nothing is imported here: import the module you need).

  quant8       blockwise 8-bit quantization of optimizer states (dynamic-tree maps), exact round trip
  adamw8bit    8-bit AdamW for one tensor: both moments as 8-bit codes, fp32 arithmetic (2.03 bytes an element)
  adafactor    Adafactor for one tensor: torch.optim.Adafactor's arithmetic, factored second moment
  muon         Muon for one matrix: momentum, Newton-Schulz orthogonalisation, the update, split for TP callers
  tensor_rules which rule each tensor gets, and the step over the tensors a data-parallel rank updates

The per-tensor modules hold math only (no communication): each function updates one tensor in place.
"""

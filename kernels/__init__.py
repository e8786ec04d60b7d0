"""Communication kernels for ZeRO++ (qwZ, qgZ). Bottom layer: imports nothing of the project but itself.

``kernels.quant`` holds the plain-torch references: blockwise int8/int4
quantization, the qgZ slice reordering (plain and pipelined) and the fused
dequantize-sum-requantize step. They define the semantics bit for bit; faster
versions (``kernels.quant_triton``) are tested against them, and ``kernels.ops``
picks one (Triton on CUDA, the references on CPU).
"""

"""Communication kernels for ZeRO++ (qwZ, qgZ).

``kernels.quant`` holds the plain-torch references: blockwise int8/int4
quantization, the qgZ slice reordering (plain and pipelined) and the fused
dequantize-sum-requantize step. They define the semantics bit for bit; faster
versions (Triton) are tested against them.
"""

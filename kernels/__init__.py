"""Communication kernels for ZeRO++ (qwZ, qgZ). Bottom layer: imports nothing of the project but itself.

``kernels.quant`` holds the plain-torch references: blockwise int8/int4
quantization, the qgZ slice reordering (plain and pipelined) and the fused
dequantize-sum-requantize step. They define the semantics bit for bit; faster
versions are tested against them: ``kernels.quant_cpu`` (plain torch, fewer passes
and temporaries, used on CPU) and ``kernels.quant_triton`` (used on CUDA).
``kernels.ops`` picks one (``ZEROPP_REFERENCE=1``: the references themselves).
"""
